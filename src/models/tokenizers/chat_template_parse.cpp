// The chat-template parser (chat_template.h): a lexer that applies Jinja's whitespace rules as
// Transformers configures them (trim_blocks, lstrip_blocks, `-` and `+` modifiers) and a
// recursive-descent parser with Jinja2's operator precedence (parser.py: condexpr < or < and <
// not < compare < + - < ~ < * / // % < ** < unary < postfix, filters and tests).

#include "chat_template_ast.h"
#include "difftrain/core/error.h"

#include <cstdlib>
#include <set>

namespace difftrain::models::jinja {

namespace {

struct Token {
  enum class Kind {
    kText,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kString,
    kInt,
    kFloat,
    kOp,
    kEof
  };
  Kind kind = Kind::kEof;
  std::string text;
  int line = 1;
};
using TK = Token::Kind;

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  Lexer(const std::string& source, const std::string& origin) : s_(source), origin_(origin) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool strip_next = false;  // the previous tag ended with `-`
    bool trim_next = false;   // the previous block or comment tag ended without it (trim_blocks)
    while (pos < s_.size()) {
      size_t start = s_.size();
      for (const char* open : {"{{", "{%", "{#"}) start = std::min(start, s_.find(open, pos));
      size_t text_begin = pos;
      if (strip_next) {
        while (text_begin < start && is_space(s_[text_begin])) ++text_begin;
      } else if (trim_next) {
        if (s_.compare(text_begin, 1, "\n") == 0 && text_begin < start) {
          ++text_begin;
        } else if (s_.compare(text_begin, 2, "\r\n") == 0 && text_begin + 1 < start) {
          text_begin += 2;
        }
      }
      size_t text_end = start;
      if (start < s_.size()) {
        const char type = s_[start + 1];
        const char modifier = start + 2 < s_.size() ? s_[start + 2] : '\0';
        if (modifier == '-') {
          while (text_end > text_begin && is_space(s_[text_end - 1])) --text_end;
        } else if (modifier != '+' && type != '{') {
          // lstrip_blocks: spaces and tabs from the start of the line up to a block tag.
          size_t ws = text_end;
          while (ws > text_begin && (s_[ws - 1] == ' ' || s_[ws - 1] == '\t')) --ws;
          if (ws == 0 || s_[ws - 1] == '\n') text_end = ws;
        }
      }
      for (size_t k = pos; k < text_begin; ++k) line_ += s_[k] == '\n';
      if (text_end > text_begin) push(TK::kText, s_.substr(text_begin, text_end - text_begin));
      for (size_t k = text_begin; k < start; ++k) line_ += s_[k] == '\n';
      if (start >= s_.size()) break;
      const char type = s_[start + 1];
      pos = start + 2;
      if (pos < s_.size() && (s_[pos] == '-' || s_[pos] == '+')) ++pos;
      if (type == '#') {
        const size_t end = s_.find("#}", pos);
        if (end == std::string::npos) fail("a comment `{#` is never closed with `#}`");
        for (size_t k = pos; k < end; ++k) line_ += s_[k] == '\n';
        strip_next = end > pos && s_[end - 1] == '-';
        trim_next = !strip_next;
        pos = end + 2;
        continue;
      }
      const bool block = type == '%';
      push(block ? TK::kBlockBegin : TK::kVarBegin, "");
      pos = lex_tag(pos, block, strip_next);
      trim_next = block && !strip_next;
    }
    push(TK::kEof, "");
    return std::move(out_);
  }

 private:
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(
        origin_ + ": chat template line " + std::to_string(line_) + ": " + what +
        ": fix the template (tokenizer_config.json's chat_template or chat_template.jinja)");
  }

  void push(TK kind, std::string text) { out_.push_back(Token{kind, std::move(text), line_}); }

  // Tokens of one `{{ }}` or `{% %}` tag from `pos`; returns the position after its end.
  size_t lex_tag(size_t pos, bool block, bool& strip) {
    const char close = block ? '%' : '}';
    int depth = 0;  // open brackets: `}}` inside `{'a': {}}` closes dicts, not the tag (as Jinja)
    while (true) {
      if (pos >= s_.size()) fail(std::string("a tag is never closed with `") + close + "}`");
      const char c = s_[pos];
      if (is_space(c)) {
        line_ += c == '\n';
        ++pos;
        continue;
      }
      if (depth == 0 && c == '-' && s_.compare(pos + 1, 1, std::string(1, close)) == 0 &&
          s_.compare(pos + 2, 1, "}") == 0) {
        strip = true;
        push(block ? TK::kBlockEnd : TK::kVarEnd, "");
        return pos + 3;
      }
      if (depth == 0 && c == close && s_.compare(pos + 1, 1, "}") == 0) {
        strip = false;
        push(block ? TK::kBlockEnd : TK::kVarEnd, "");
        return pos + 2;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos;
        while (end < s_.size() &&
               (std::isalnum(static_cast<unsigned char>(s_[end])) || s_[end] == '_')) {
          ++end;
        }
        push(TK::kName, s_.substr(pos, end - pos));
        pos = end;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t end = pos;
        bool is_float = false;
        while (end < s_.size() &&
               (std::isdigit(static_cast<unsigned char>(s_[end])) || s_[end] == '_')) {
          ++end;
        }
        if (end + 1 < s_.size() && s_[end] == '.' &&
            std::isdigit(static_cast<unsigned char>(s_[end + 1]))) {
          is_float = true;
          ++end;
          while (end < s_.size() && std::isdigit(static_cast<unsigned char>(s_[end]))) ++end;
        }
        if (end < s_.size() && (s_[end] == 'e' || s_[end] == 'E')) {
          size_t e = end + 1;
          if (e < s_.size() && (s_[e] == '+' || s_[e] == '-')) ++e;
          if (e < s_.size() && std::isdigit(static_cast<unsigned char>(s_[e]))) {
            is_float = true;
            end = e;
            while (end < s_.size() && std::isdigit(static_cast<unsigned char>(s_[end]))) ++end;
          }
        }
        std::string number;
        for (size_t k = pos; k < end; ++k) {
          if (s_[k] != '_') number += s_[k];
        }
        push(is_float ? TK::kFloat : TK::kInt, number);
        pos = end;
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                     "/",  "%",  "~",  "|",  ".",  ",",  ":", "(", ")",
                                     "[",  "]",  "{",  "}",  "=",  "<",  ">"};
        bool found = false;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (s_.compare(pos, n, op) == 0) {
            push(TK::kOp, op);
            pos += n;
            if (n == 1 && (*op == '(' || *op == '[' || *op == '{')) ++depth;
            if (n == 1 && (*op == ')' || *op == ']' || *op == '}') && depth > 0) --depth;
            found = true;
            break;
          }
        }
        if (!found) fail(std::string("unexpected character '") + c + "' in a tag");
      }
    }
  }

  // A quoted string with Python's escapes (Jinja decodes them with "unicode-escape").
  size_t lex_string(size_t pos) {
    const char quote = s_[pos];
    std::string out;
    const int first_line = line_;
    size_t k = pos + 1;
    while (true) {
      if (k >= s_.size()) {
        line_ = first_line;
        fail("a string is never closed");
      }
      const char c = s_[k];
      if (c == quote) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        out += c;
        ++k;
        continue;
      }
      if (k + 1 >= s_.size()) fail("a string ends in a backslash");
      const char e = s_[k + 1];
      k += 2;
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case 'a': out += '\a'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': ++line_; break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t digits = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          if (k + digits > s_.size()) fail("a truncated \\" + std::string(1, e) + " escape");
          const std::string hex = s_.substr(k, digits);
          char* end = nullptr;
          const unsigned long cp = std::strtoul(hex.c_str(), &end, 16);
          if (end != hex.c_str() + hex.size()) fail("a bad \\" + std::string(1, e) + " escape");
          append_utf8(out, static_cast<uint32_t>(cp));
          k += digits;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int d = 0; d < 2 && k < s_.size() && s_[k] >= '0' && s_[k] <= '7'; ++d, ++k) {
              cp = cp * 8 + static_cast<uint32_t>(s_[k] - '0');
            }
            append_utf8(out, cp);
          } else {
            out += '\\';  // Python keeps an unknown escape as written
            out += e;
          }
      }
    }
    push(TK::kString, out);
    return k + 1;
  }

  const std::string& s_;
  const std::string& origin_;
  std::vector<Token> out_;
  int line_ = 1;
};

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& origin)
      : t_(std::move(tokens)), origin_(origin) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool is_op(const char* op) const { return cur().kind == TK::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().kind == TK::kName && cur().text == name; }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(
        origin_ + ": chat template line " + std::to_string(cur().line) + ": " + what +
        ": fix the template (tokenizer_config.json's chat_template or chat_template.jinja)");
  }
  static std::string describe(const Token& t) {
    switch (t.kind) {
      case TK::kEof: return "the end of the template";
      case TK::kBlockEnd: return "`%}`";
      case TK::kVarEnd: return "`}}`";
      case TK::kString: return "a string";
      default: return "`" + t.text + "`";
    }
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected `") + op + "`, found " + describe(cur()));
    ++i_;
  }
  std::string expect_name() {
    if (cur().kind != TK::kName) fail("expected a name, found " + describe(cur()));
    return t_[i_++].text;
  }
  void expect_block_end() {
    if (cur().kind != TK::kBlockEnd) fail("expected `%}`, found " + describe(cur()));
    ++i_;
  }

  // Statements up to a block tag named in `ends` (consumed up to its name; `end` gets it).
  Body parse_body(const std::set<std::string>& ends, std::string& end) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.kind == TK::kEof) {
        if (!ends.empty())
          fail("the template ends inside a block: expected `{% " + *ends.rbegin() + " %}`");
        return body;
      }
      if (t.kind == TK::kText) {
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->text = t.text;
        s->line = t.line;
        body.push_back(s);
        ++i_;
      } else if (t.kind == TK::kVarBegin) {
        ++i_;
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        s->expr = parse_expression();
        if (cur().kind != TK::kVarEnd) fail("expected `}}`, found " + describe(cur()));
        ++i_;
        body.push_back(s);
      } else if (t.kind == TK::kBlockBegin) {
        ++i_;
        const std::string name = expect_name();
        if (ends.count(name) != 0) {
          end = name;
          return body;
        }
        body.push_back(parse_statement(name, t.line));
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  std::shared_ptr<Stmt> parse_statement(const std::string& name, int line) {
    auto s = std::make_shared<Stmt>();
    s->line = line;
    std::string end;
    if (name == "if") {
      s->kind = Stmt::Kind::kIf;
      s->conditions.push_back(parse_expression());
      expect_block_end();
      while (true) {
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, end));
        if (end == "elif") {
          s->conditions.push_back(parse_expression());
          expect_block_end();
        } else {
          break;
        }
      }
      if (end == "else") {
        expect_block_end();
        s->else_body = parse_body({"endif"}, end);
      }
      expect_block_end();
    } else if (name == "for") {
      s->kind = Stmt::Kind::kFor;
      s->targets.push_back(expect_name());
      while (is_op(",")) {
        ++i_;
        s->targets.push_back(expect_name());
      }
      if (!is_name("in")) fail("expected `in` in a for loop, found " + describe(cur()));
      ++i_;
      s->expr = parse_or();
      if (is_name("if")) {
        ++i_;
        s->condition = parse_or();
      }
      if (is_name("recursive")) fail("recursive for loops are not supported");
      expect_block_end();
      s->body = parse_body({"else", "endfor"}, end);
      if (end == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, end);
      }
      expect_block_end();
    } else if (name == "set") {
      s->targets.push_back(expect_name());
      if (is_op(".")) {
        ++i_;
        s->attribute = expect_name();
      }
      while (s->attribute.empty() && is_op(",")) {
        ++i_;
        s->targets.push_back(expect_name());
      }
      if (cur().kind == TK::kBlockEnd && s->targets.size() == 1 && s->attribute.empty()) {
        ++i_;
        s->kind = Stmt::Kind::kSetBlock;
        s->body = parse_body({"endset"}, end);
        expect_block_end();
      } else {
        s->kind = Stmt::Kind::kSet;
        expect_op("=");
        s->expr = parse_tuple();
        expect_block_end();
      }
    } else if (name == "break" || name == "continue") {
      s->kind = name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      expect_block_end();
    } else if (name == "generation") {
      s->kind = Stmt::Kind::kGeneration;
      expect_block_end();
      s->body = parse_body({"endgeneration"}, end);
      expect_block_end();
    } else {
      --i_;
      fail("the tag `{% " + name +
           " %}` is not supported by difftrain's chat templates (if, "
           "for, set, break, continue, generation are)");
    }
    return s;
  }

  ExprPtr make(Expr::Kind kind, std::string text, std::vector<ExprPtr> args, int line) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->text = std::move(text);
    e->args = std::move(args);
    e->line = line;
    return e;
  }

  // `a, b` as a list (Jinja's tuple) where a statement allows one.
  ExprPtr parse_tuple() {
    const int line = cur().line;
    ExprPtr first = parse_expression();
    if (!is_op(",")) return first;
    std::vector<ExprPtr> items{first};
    while (is_op(",")) {
      ++i_;
      items.push_back(parse_expression());
    }
    return make(Expr::Kind::kList, "", std::move(items), line);
  }

  ExprPtr parse_expression() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      ++i_;
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (is_name("else")) {
        ++i_;
        otherwise = parse_expression();
      }
      e = make(Expr::Kind::kCondition, "", {condition, e, otherwise}, line);
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const int line = cur().line;
      ++i_;
      e = make(Expr::Kind::kBinary, "or", {e, parse_and()}, line);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const int line = cur().line;
      ++i_;
      e = make(Expr::Kind::kBinary, "and", {e, parse_not()}, line);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      const int line = cur().line;
      ++i_;
      return make(Expr::Kind::kUnary, "not", {parse_not()}, line);
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    ExprPtr chain;
    while (true) {
      const int line = cur().line;
      std::string op;
      if (cur().kind == TK::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" ||
           cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        ++i_;
      } else if (is_name("in")) {
        op = "in";
        ++i_;
      } else if (is_name("not") && peek().kind == TK::kName && peek().text == "in") {
        op = "not in";
        i_ += 2;
      } else {
        break;
      }
      ExprPtr right = parse_math1();
      // a < b < c is (a < b) and (b < c), as in Python.
      ExprPtr pair = make(Expr::Kind::kCompare, op, {e, right}, line);
      chain = chain ? make(Expr::Kind::kBinary, "and", {chain, pair}, line) : pair;
      e = right;
    }
    return chain ? chain : e;
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token op = cur();
      ++i_;
      e = make(Expr::Kind::kBinary, op.text, {e, parse_concat()}, op.line);
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const int line = cur().line;
      ++i_;
      e = make(Expr::Kind::kBinary, "~", {e, parse_math2()}, line);
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token op = cur();
      ++i_;
      e = make(Expr::Kind::kBinary, op.text, {e, parse_pow()}, op.line);
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      ++i_;
      e = make(Expr::Kind::kBinary, "**", {e, parse_unary(true)}, line);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    const int line = cur().line;
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const std::string op = cur().text;
      ++i_;
      e = make(Expr::Kind::kUnary, op, {parse_unary(false)}, line);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(e);
    if (with_filter) e = parse_filters(e);
    return e;
  }

  ExprPtr parse_primary() {
    const Token t = cur();
    auto literal = [&](Json v) {
      auto e = std::make_shared<Expr>();
      e->kind = Expr::Kind::kLiteral;
      e->value = std::move(v);
      e->line = t.line;
      return e;
    };
    if (t.kind == TK::kName) {
      ++i_;
      if (t.text == "true" || t.text == "True") return literal(true);
      if (t.text == "false" || t.text == "False") return literal(false);
      if (t.text == "none" || t.text == "None") return literal(nullptr);
      return make(Expr::Kind::kName, t.text, {}, t.line);
    }
    if (t.kind == TK::kString) {
      std::string s;
      while (cur().kind == TK::kString) s += t_[i_++].text;  // adjacent strings join
      return literal(s);
    }
    if (t.kind == TK::kInt) {
      ++i_;
      return literal(static_cast<int64_t>(std::strtoll(t.text.c_str(), nullptr, 10)));
    }
    if (t.kind == TK::kFloat) {
      ++i_;
      return literal(std::strtod(t.text.c_str(), nullptr));
    }
    if (is_op("(")) {
      ++i_;
      if (is_op(")")) {
        ++i_;
        return make(Expr::Kind::kList, "", {}, t.line);
      }
      ExprPtr e = parse_tuple();
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++i_;
      std::vector<ExprPtr> items;
      while (!is_op("]")) {
        items.push_back(parse_expression());
        if (!is_op(",")) break;
        ++i_;
      }
      expect_op("]");
      return make(Expr::Kind::kList, "", std::move(items), t.line);
    }
    if (is_op("{")) {
      ++i_;
      std::vector<ExprPtr> items;
      while (!is_op("}")) {
        items.push_back(parse_expression());
        expect_op(":");
        items.push_back(parse_expression());
        if (!is_op(",")) break;
        ++i_;
      }
      expect_op("}");
      return make(Expr::Kind::kDict, "", std::move(items), t.line);
    }
    fail("unexpected " + describe(t) + " in an expression");
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (is_op(".")) {
        ++i_;
        if (cur().kind == TK::kInt) {
          auto index = std::make_shared<Expr>();
          index->value = static_cast<int64_t>(std::strtoll(cur().text.c_str(), nullptr, 10));
          index->line = line;
          ++i_;
          e = make(Expr::Kind::kItem, "", {e, index}, line);
        } else {
          e = make(Expr::Kind::kAttr, expect_name(), {e}, line);
        }
      } else if (is_op("[")) {
        ++i_;
        e = parse_subscript(e, line);
      } else if (is_op("(")) {
        e = parse_call(make(Expr::Kind::kCall, "", {e}, line));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(const ExprPtr& target, int line) {
    ExprPtr parts[3];
    bool slice = false;
    for (int k = 0; k < 3; ++k) {
      if (!is_op(":") && !is_op("]")) parts[k] = parse_expression();
      if (k < 2 && is_op(":")) {
        ++i_;
        slice = true;
      } else {
        break;
      }
    }
    expect_op("]");
    if (!slice) return make(Expr::Kind::kItem, "", {target, parts[0]}, line);
    return make(Expr::Kind::kSlice, "", {target, parts[0], parts[1], parts[2]}, line);
  }

  // `(args, name=value)` appended to `call`'s args and keywords.
  ExprPtr parse_call(ExprPtr call) {
    auto e = std::make_shared<Expr>(*call);
    expect_op("(");
    while (!is_op(")")) {
      if (cur().kind == TK::kName && peek().kind == TK::kOp && peek().text == "=") {
        const std::string key = cur().text;
        i_ += 2;
        e->keywords.emplace_back(key, parse_expression());
      } else {
        if (!e->keywords.empty()) fail("a positional argument after a keyword argument");
        e->args.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      ++i_;
    }
    expect_op(")");
    return e;
  }

  ExprPtr parse_filters(ExprPtr e) {
    while (true) {
      const int line = cur().line;
      if (is_op("|")) {
        ++i_;
        auto f = make(Expr::Kind::kFilter, expect_name(), {e}, line);
        e = is_op("(") ? parse_call(f) : f;
      } else if (is_name("is")) {
        ++i_;
        bool negated = false;
        if (is_name("not")) {
          negated = true;
          ++i_;
        }
        auto test = std::make_shared<Expr>();
        test->kind = Expr::Kind::kTest;
        test->line = line;
        test->negated = negated;
        // Tests named by operators (`is ==` is rare; names are the rule).
        test->text = expect_name();
        test->args = {e};
        if (is_op("(")) {
          e = parse_call(test);
        } else {
          const Token& a = cur();
          const bool takes_arg =
              (a.kind == TK::kName || a.kind == TK::kString || a.kind == TK::kInt ||
               a.kind == TK::kFloat ||
               (a.kind == TK::kOp && (a.text == "(" || a.text == "[" || a.text == "{"))) &&
              !(a.kind == TK::kName &&
                (a.text == "else" || a.text == "or" || a.text == "and" || a.text == "if"));
          if (takes_arg) test->args.push_back(parse_postfix(parse_primary()));
          e = test;
        }
      } else if (is_op("(")) {
        e = parse_call(make(Expr::Kind::kCall, "", {e}, line));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  const std::string& origin_;
};

}  // namespace

Body parse(const std::string& source, const std::string& origin) {
  // Jinja drops one newline at the very end of a template (keep_trailing_newline=False).
  std::string text = source;
  if (text.size() >= 2 && text.compare(text.size() - 2, 2, "\r\n") == 0) {
    text.resize(text.size() - 2);
  } else if (!text.empty() && (text.back() == '\n' || text.back() == '\r')) {
    text.pop_back();
  }
  Lexer lexer(text, origin);
  Parser parser(lexer.run(), origin);
  return parser.parse_template();
}

}  // namespace difftrain::models::jinja
